"""One-row GEMV for decode (`k3::gemv`): whole weight rows held in registers, loaded before the PDL wait."""
