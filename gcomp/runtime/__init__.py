"""gcomp.runtime"""
