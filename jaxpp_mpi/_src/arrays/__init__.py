"""Meshes and arrays: MpmdMesh and its device views, make_mpmd_mesh, MpmdSharding and MpmdArray."""
