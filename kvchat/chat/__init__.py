"""The chat service: what the app and the CLI do besides drawing and parsing (a
conversation, its turns, method switches, compare, the memory map as text). No Textual."""
