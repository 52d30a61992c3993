"""Data plane: framed messages over a unix socket, large tensors in shared memory.

`wire` (with `codec` and `segment`) is shared by the daemon and the client adapter, so this
package imports nothing heavier than torch and cloudpickle at import time; the server lives in
`salus.daemon.frontend.server`.
"""
