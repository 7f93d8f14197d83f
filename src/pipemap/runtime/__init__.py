"""What every hook stands on: how tensors move and the peer-copy check (``transfer``), copy queues (``streams``),
the memory ledger calls are admitted by (``admission``), and the one record pipemap keeps on a placed pipeline
(``placed``). It imports no hook and no dispatch: those wings stand on it. Nothing is imported here: each module is
imported by name."""
