"""Training across MPI ranks (docs/distributed.md): partition, halo runtime, trainer."""
