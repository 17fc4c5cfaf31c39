"""astrai: build, train and serve small Chinese/English language models on PyTorch."""

__version__ = "0.1.0"

from astrai.errors import AstraiError, CheckpointError, ConfigError, DataError, OverloadedError, RequestError  # noqa: E402

__all__ = ["AstraiError", "CheckpointError", "ConfigError", "DataError", "OverloadedError", "RequestError", "__version__"]
