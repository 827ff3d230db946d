"""What the other ranks of a group learn when rank 0 fails while they wait on it.

NOTE: why they are told. Rank 0 (the process the user started) can fail on its own while alive: its
set-up, its warmup, a step. The others wait on it in a collective, so until it exits, which a local
rank 0 does only after waiting for them, they waited out the group timeout (60 s by default). So rank
0 tells them where they wait: in the KV pool's agreement (kv_pool_agreement.py) before it, on the
step feed (ABORT, distributed/step_broadcast.py) after. They stop at once and exit non-zero, leaving
the failure's traceback to rank 0's log.
"""

from __future__ import annotations


class RankZeroFailed(Exception):
    """Rank 0 said it failed; its log says why. This rank stops and exits non-zero."""
