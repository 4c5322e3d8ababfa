"""The warmup channel: an authenticated UDP signal that a user focused the input box of a session."""
