"""Scale-out on Ray Serve: the deployment (`serve`), its per-replica metrics (`metrics`, `targets`)."""
