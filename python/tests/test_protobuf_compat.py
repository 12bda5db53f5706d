"""The client on the older protobuf and grpcio runtimes ML environments pin.

Each case makes (once, then reuses) a virtualenv under ~/.cache/stepwatch/venvs
holding only the pinned protobuf and grpcio, and runs the client from this tree
in it against the real agent: hello and markers out, the agent's API showing
them, and an advisory decoded back. The newest runtimes are what the rest of
the suite runs on. Skipped only when the package index is unreachable.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from test_agent_integration import _Agent, agent_binary  # noqa: F401 (fixture helpers)
from test_proto_stubs import load_generator

PY_ROOT = Path(__file__).resolve().parents[1]

# The oldest of each gencode's range (see tools/gen_proto.py): the floors in
# pyproject.toml, and a 5.x runtime on the protobuf-4 gencode.
CASES = {
    "protobuf-4.21-grpcio-1.51": ["protobuf==4.21.6", "grpcio==1.51.3"],
    "protobuf-5.26-grpcio-1.62": ["protobuf==5.26.1", "grpcio==1.62.3"],
}

CLIENT = textwrap.dedent(
    """
    import json, sys
    import google.protobuf, grpc
    import stepwatch
    from stepwatch._client import Client
    from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb

    stepwatch.configure(job_id=sys.argv[1], strict=True)
    for _ in range(2):
        with stepwatch.step():
            for phase in ("forward", "backward", "optimizer"):
                with stepwatch.phase(phase):
                    pass
    ok = stepwatch.flush(60)
    # The agent's side of the wire: an advisory as it would arrive.
    seen = []
    c = Client("unix:///nonexistent", pb.Hello, on_advisory=seen.append)
    wire = pb.AgentMessage(advisory=pb.Advisory(kind=1, severity=3, message="m", step=1))
    c._on_agent_message(pb.AgentMessage.FromString(wire.SerializeToString()))
    print(json.dumps({
        "flushed": ok,
        "stats": stepwatch.stats(),
        "run_id": stepwatch._runtime.RT.run_id,
        "protobuf": google.protobuf.__version__,
        "grpcio": grpc.__version__,
        "gencode": sorted(m for m in sys.modules if m.endswith(("_pb2_v4", "_pb2_v6"))),
        "advisory": [seen[0].kind, seen[0].severity] if seen else None,
    }))
    stepwatch.shutdown()
    """
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_client_round_trips_on_an_older_runtime(case, sock_dir, tmp_path):
    gen = load_generator()
    specs = CASES[case]
    try:
        name = "_".join(spec.replace("==", "-") for spec in specs)
        python = gen.throwaway_venv(name, specs, "import grpc, google.protobuf")
    except gen.VenvUnavailable as e:
        if e.offline:
            pytest.skip(f"the package index is unreachable, so {specs} cannot be had: {e}")
        raise
    agent = _Agent(agent_binary(), sock_dir, tmp_path)
    agent.start()
    try:
        job = f"compat-{uuid.uuid4().hex[:8]}"
        env = dict(
            os.environ,
            PYTHONPATH=str(PY_ROOT),
            STEPWATCH_ENDPOINT="unix://" + agent.socket,
        )
        done = subprocess.run(
            [str(python), "-c", CLIENT, job], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
        want = {s.split("==")[0]: s.split("==")[1] for s in specs}
        assert (out["protobuf"], out["grpcio"]) == (want["protobuf"], want["grpcio"]), out
        assert out["gencode"] == ["stepwatch._proto.stepwatch.v1.ingest_pb2_v4"], out
        assert out["flushed"] and out["stats"]["sent"] == 12, out
        assert out["stats"]["rejections"] == 0, out
        assert out["advisory"] == ["ADVISORY_KIND_STEP2_OOM_PREDICTED", "SEVERITY_CRITICAL"]
        deadline = time.monotonic() + 15
        report = None
        while time.monotonic() < deadline:
            report = agent.get(f"/api/v1/jobs/{job}/ranks/0")
            if report and report["steps_completed"] == 2:
                break
            time.sleep(0.05)
        assert report and report["steps_completed"] == 2, (report, agent.log.read_text())
        assert [s["step"] for s in report["steps"]] == [1, 2]
        assert report["info"]["run_id"] == out["run_id"]
    finally:
        agent.stop()
