"""Flower strategies and the ServerApp: private aggregation and accounting over the Grid."""
