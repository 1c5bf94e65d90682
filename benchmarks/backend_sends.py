"""How many responses a second one Python-backend model instance can send, with no engine behind it.

A toy decoupled model (written to a scratch repository) answers each request with N small responses from a pool
of sender threads; `--busy-ms` adds a thread that sleeps 6 ms, then holds the interpreter for that long, over and
over, as a step loop in the same process would. The client reads K concurrent gRPC streams. One line per setting:

  python benchmarks/backend_sends.py --threads 1,4 --busy-ms 0,3
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tritonllm.launch.pytriton_wheel import prepare_backends, pytriton_root, server_env
from tritonllm.launch.tritonserver import free_port, http_ready

CONFIG = """name: "sender"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 8 ] } ]
parameters { key: "threads" value: { string_value: "%d" } }
parameters { key: "busy_ms" value: { string_value: "%g" } }
"""

MODEL = """
import json, queue, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.requests = queue.SimpleQueue()
        for _ in range(int(params["threads"])):
            threading.Thread(target=self.send_all, daemon=True).start()
        if float(params["busy_ms"]):
            threading.Thread(target=self.busy, args=(float(params["busy_ms"]) / 1000,), daemon=True).start()

    def busy(self, seconds):
        while True:
            time.sleep(0.006)
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                sum(range(200))

    def send_all(self):
        out = np.arange(8, dtype=np.int32)
        while True:
            request = self.requests.get()
            sender = request.get_response_sender()
            for _ in range(int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests):
        for request in requests:
            self.requests.put(request)
"""


async def read_streams(url: str, streams: int, responses: int) -> float:
    """Responses a second over `streams` concurrent requests of `responses` each."""
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(url)

    async def one(count: int) -> int:
        tensor = grpcclient.InferInput("N", [1], "INT32")
        tensor.set_data_from_numpy(np.array([count], dtype=np.int32))

        async def requests():
            yield {"model_name": "sender", "inputs": [tensor]}

        got = 0
        async for _, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(error)
            got += 1
            if got == count:
                return got
        return got

    try:
        await one(10)  # warm-up
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(responses) for _ in range(streams)))
        return sum(counts) / (time.perf_counter() - started)
    finally:
        await client.close()


def measure(scratch: Path, threads: int, busy_ms: float, streams: int, responses: int) -> float:
    model = scratch / "repository" / "sender"
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(CONFIG % (threads, busy_ms))
    (model / "1" / "model.py").write_text(MODEL)
    http, grpc, metrics = free_port(), free_port(), free_port()
    command = [
        str(pytriton_root() / "tritonserver" / "bin" / "tritonserver"),
        f"--model-repository={scratch / 'repository'}",
        f"--backend-directory={prepare_backends(scratch / 'work')}",
        *(
            f"--{api}-{what}={value}"
            for api, port in (("http", http), ("grpc", grpc), ("metrics", metrics))
            for what, value in (("address", "127.0.0.1"), ("port", port))
        ),
    ]
    with open(scratch / "server.log", "w") as log:
        server = subprocess.Popen(command, env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not http_ready(f"127.0.0.1:{http}"):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = (scratch / "server.log").read_text()[-2000:]
                raise SystemExit(f"backend_sends: the server did not start; its log ends:\n{tail}")
            time.sleep(0.3)
        return asyncio.run(read_streams(f"127.0.0.1:{grpc}", streams, responses))
    finally:
        server.terminate()
        server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,4", help="sender threads in the model, comma-separated settings")
    parser.add_argument(
        "--busy-ms", default="0,3", help="interpreter time taken after each 6 ms sleep, comma-separated"
    )
    parser.add_argument("--streams", type=int, default=8, help="concurrent requests")
    parser.add_argument("--responses", type=int, default=2000, help="responses per request")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="backend-sends-") as scratch:
        for busy in (float(v) for v in args.busy_ms.split(",")):
            for threads in (int(v) for v in args.threads.split(",")):
                rate = measure(Path(scratch), threads, busy, args.streams, args.responses)
                print(f"threads {threads}, busy {busy:g} ms after each 6 ms: {rate:,.0f} responses/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
