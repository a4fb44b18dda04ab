"""Prefect flows: data preparation, base model, DAPO training, evaluation, deployment."""
