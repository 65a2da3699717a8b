"""Endpoint discovery: a static list or file, or Kubernetes pods selected by an InferencePool."""
