"""The code on the workers: local git (gitops), one writer at a time (codelock), deploy."""
