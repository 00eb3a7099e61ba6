import os
import sys

# Workers are spawned processes that import helpers from this folder by module name.
sys.path.insert(0, os.path.dirname(__file__))
