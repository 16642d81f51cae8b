"""Parallelism applied from outside the model: the mesh (dims.py), its composition (parallelize.py), and its parts."""
