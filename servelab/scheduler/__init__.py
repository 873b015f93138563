"""The scheduler room: one request object from admission to its end (`state`), the admission rules (`policy`), the
paged KV pool's books (`blocks`), and the scheduler that owns a worker's requests and pool and plans each step
(`scheduler`): which rows compute how many tokens in which blocks, who joins and who is preempted. Pure: no Redis,
SQL or torch."""
