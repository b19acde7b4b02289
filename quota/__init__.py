"""GPUQuota: the model, the ledger, validating admission and the usage controller."""
