"""The esamp dashboard (Textual). Talks to esamp only through the session and its events."""
