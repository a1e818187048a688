from attnum.testing import attention_close  # noqa: F401  (the helper's pytest fixture, as a kernel project uses it)
