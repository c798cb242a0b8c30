from kvfleet_sim.cli import sim

sim(prog_name="python -m kvfleet_sim")
