"""Federated jobs: FedAvg and FedProx over simulated clients, synthetic(alpha, beta) data."""
