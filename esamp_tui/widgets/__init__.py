"""Widgets of the dashboard. None of them imports the app or a screen."""
