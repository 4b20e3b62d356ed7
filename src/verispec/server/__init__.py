"""`verispec serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    protocol.py   OpenAI request bodies -> checked specs; errors in OpenAI's shape
    scheduler.py  the worker thread: queue, admission, lanes of DecodeBatch, events back to requests
    metrics.py    Prometheus text for /metrics
    app.py        the FastAPI app, `serve` and the `verispec serve` command line
    process.py    a server in a child process, for tests and benchmarks
"""

from verispec.server.app import build_app, main, serve
from verispec.server.process import ServerProcess
from verispec.server.scheduler import Job, JobFailed, QueueFull, Scheduler

__all__ = ["build_app", "main", "serve", "ServerProcess", "Job", "JobFailed", "QueueFull", "Scheduler"]
