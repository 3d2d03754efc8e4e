"""Our kernels inside other libraries: huggingface (transformers' attention implementations).
Each module imports its library only when used."""
