# Written by hand beside the gencode of python/tools/gen_proto.py.
"""The stepwatch.v1 messages, from the gencode made for the protobuf runtime in use.

Protobuf supports gencode of major version V on runtimes V and V+1 only, never
on a runtime older than the protoc that made it
(https://protobuf.dev/support/cross-version-runtime-guarantee/): ingest_pb2_v4
(protoc 3.21) serves protobuf 4.21.6 to 5.x, ingest_pb2_v6 (protoc 30) 6.30 on.
"""
import re as _re

from google.protobuf import __version__ as _runtime

_version = tuple(int(n) for n in _re.findall(r"\d+", _runtime)[:3])
if _version >= (6, 30, 0):
    from .ingest_pb2_v6 import *  # noqa: F401,F403
elif (4, 21, 6) <= _version < (6,):
    from .ingest_pb2_v4 import *  # noqa: F401,F403
else:
    raise ImportError(
        f"stepwatch needs protobuf >= 4.21.6 (not 6.0 to 6.29, which were never "
        f"released), and this environment has protobuf {_runtime}: "
        f"pip install 'protobuf>=4.21.6'"
    )
