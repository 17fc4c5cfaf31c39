"""astrai.parallel: process groups, data-parallel wrapping, tensor-parallel linears."""

from astrai.parallel.setup import (cleanup_parallel, get_current_device, get_rank, get_world_size, is_distributed,
                                   only_on_rank, setup_parallel, spawn_parallel_fn, torchrun_env)
from astrai.parallel.tensor_parallel import ColumnParallelLinear, ParallelModel, RowParallelLinear
from astrai.parallel.wrap import no_sync, unwrap_model, wrap_model

__all__ = ["ColumnParallelLinear", "ParallelModel", "RowParallelLinear", "cleanup_parallel", "get_current_device",
           "get_rank", "get_world_size", "is_distributed", "no_sync", "only_on_rank", "setup_parallel",
           "spawn_parallel_fn", "torchrun_env", "unwrap_model", "wrap_model"]
