"""Interop with other GPU libraries: foreign arrays, the CUDA Array Interface, DLPack."""
