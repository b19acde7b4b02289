"""End-to-end tests against a real cluster named by FRACGPU_E2E_KUBECONFIG (skipped without it)."""
