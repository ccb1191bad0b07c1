"""Flower ClientApp: a node hosts a cohort of users and runs their user-side steps."""
