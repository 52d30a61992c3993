"""The kubelet's gRPC APIs the device plugin speaks, and the Python modules generated from them.

Nothing here is salusd's own code: the `.proto` files restate Kubernetes' API definitions, and
the `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` modules are generated from them by grpcio-tools
and committed unedited. See README.md beside this file for the upstream files and versions, and
`make k8s-stubs` to regenerate the modules.
"""
