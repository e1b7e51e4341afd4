"""gcomp's benchmark harness: gcomp against PyG and DGL (see README.md)."""
