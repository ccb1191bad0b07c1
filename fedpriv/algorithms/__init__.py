"""One module per algorithm: the user-side step and the server-side step, over batches of users."""
