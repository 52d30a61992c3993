"""Communication as a service to jobs: collectives with the torch.distributed convention, PTO."""
