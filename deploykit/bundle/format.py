"""What makes a directory a deploykit bundle: the manifest's name, its format tag and version."""

MANIFEST = "manifest.json"
FORMAT = "deploykit-bundle"
#: Bumped when a reader of an older version could misread a bundle; readers refuse newer ones.
FORMAT_VERSION = 1
