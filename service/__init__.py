"""kvsentry HTTP service: the OpenAI-compatible front end of the DP ranks."""
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("kvsentry")
except PackageNotFoundError:  # running from a checkout without `pip install -e .`
    __version__ = "0.1.0"
