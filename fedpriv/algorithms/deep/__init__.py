"""Deep personalization on real data: a torch body shared by all users, a personal linear head."""
