"""Package list for the three stage folders, computed so a built wheel holds every subpackage.

With ``package-dir`` a subpackage missing from ``packages`` still imports from an
editable install but is absent from the wheel; listing them by hand drifts.
"""

from setuptools import find_packages, setup

STAGES = ("generate", "store", "train")

# "rollshard" itself is an implicit namespace: the layout has no folder for it.
packages = []
package_dir = {}
for stage in STAGES:
    packages.append(f"rollshard.{stage}")
    package_dir[f"rollshard.{stage}"] = stage
    for sub in find_packages(stage):
        packages.append(f"rollshard.{stage}.{sub}")

setup(packages=packages, package_dir=package_dir)
