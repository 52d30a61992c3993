"""salusd package."""
