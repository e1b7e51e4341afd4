"""gcomp.frontend"""
