"""astrai.serialization: training checkpoints on disk."""

from astrai.serialization.checkpoint import (Checkpoint, latest_checkpoint, list_checkpoints, prune_checkpoints,
                                            remove_stale_saves)

__all__ = ["Checkpoint", "latest_checkpoint", "list_checkpoints", "prune_checkpoints", "remove_stale_saves"]
