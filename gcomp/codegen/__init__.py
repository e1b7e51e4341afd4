"""gcomp.codegen"""
