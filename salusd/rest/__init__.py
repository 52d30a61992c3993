"""The REST control plane: FastAPI served by uvicorn on a thread of the daemon.

Handlers never touch the engine from their own thread: every read and change runs on the
daemon's I/O thread through `EngineBridge`, so the engine stays single-threaded.
"""
