"""Sessions on disk: the SQLite database (`db`), its numbered migrations
(`migrations`), the tensor codec and delta planner for snapshots (`codec`), and
`persist`, which turns a chat session into what the database stores and back."""
