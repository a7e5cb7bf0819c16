"""Screens of the dashboard: the main screen and its modals."""
