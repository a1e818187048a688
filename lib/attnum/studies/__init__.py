"""The computations behind each study notebook (the notebooks hold the story)."""
