"""The runtime's shared machinery under every hook: how tensors move and the peer-copy check (``transfer``), copy
queues (``streams``), the memory ledger calls are admitted by (``admission``), the move to the host on an
out-of-memory error (``relief``), the bytes each path carried (``traffic``), requests run together (``parallel``),
and loading a folder onto its plan (``loading``). Nothing is imported here: each module is imported by name."""
