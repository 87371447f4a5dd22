"""How AFlex's processes talk: the NATS bus and embedded server (control plane) and the seam
transports that carry the per-layer tensors between attention and FFN workers (data plane)."""
