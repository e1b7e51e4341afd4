"""gcomp.passes"""
