"""The scheduler room: one request state (`state`), the admission rules (`policy`), and the scheduler that owns
a worker's waiting and running requests and plans each step (`scheduler`). Pure: no Redis, SQL or torch."""
