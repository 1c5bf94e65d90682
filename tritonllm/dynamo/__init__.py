"""NVIDIA Dynamo: this server as a worker of a Dynamo fleet (frontend, KV-aware router)."""
