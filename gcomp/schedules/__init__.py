"""Target schedules: how each kernel kind of ``gcomp.codegen.kernels`` runs on a target."""
