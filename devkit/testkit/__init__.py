"""Builders of real upstream objects on CPU (caches, schedulers, pools) shared by tests and benchmarks.

Never imported by a switch or by ``sitecustomize``: only tests, benchmarks and the gate use it.
"""
