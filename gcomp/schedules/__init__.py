"""gcomp.schedules"""
